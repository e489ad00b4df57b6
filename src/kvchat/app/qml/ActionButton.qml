// A small icon button under a message, with its name as a tooltip.
import QtQuick
import QtQuick.Controls

ToolButton {
    property string iconName
    property string tip
    implicitWidth: 28
    implicitHeight: 28
    icon.source: iconDir + "/" + iconName + ".svg"
    icon.width: 16
    icon.height: 16
    icon.color: hovered ? theme.colours.text : theme.colours.muted
    ToolTip.visible: hovered && tip.length > 0
    ToolTip.text: tip
    ToolTip.delay: 300
}
